"""Test-wide setup: the typed config groups are registered in Hydra's ConfigStore before any test composes the
config (the scripts import ``configs.typed`` themselves)."""

import configs.typed  # noqa: F401
