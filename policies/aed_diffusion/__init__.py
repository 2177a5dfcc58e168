"""The AED diffusion policy (configuration, model, checkpoint format)."""

from policies.aed_diffusion.configuration_aed_diffusion import AEDConfig, AEDDiffusionConfig, MTLossConfig
from policies.aed_diffusion.modeling_aed_diffusion import AEDDiffusionPolicy

__all__ = ["AEDConfig", "AEDDiffusionConfig", "AEDDiffusionPolicy", "MTLossConfig"]
