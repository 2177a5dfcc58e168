"""Feature names the policies, their critics and the deploy runtime share (LeRobot's ``observation.*`` names).
Import-light on purpose: no torch, so a config can name them without loading a model."""

POINT_CLOUD = "observation.point_cloud"
"""A depth camera's workspace point cloud, ``(N, 3)`` float32 metres in the robot's base frame (``sim.pointcloud``)."""

POINT_COLORS = "observation.point_colors"
"""The colours of :data:`POINT_CLOUD`'s points, ``(N, 3)`` uint8 RGB, row i the colour of point i (``sim.pointcloud``,
``obs.point_color``)."""


def point_in_dim(relative: bool, color: bool) -> int:
    """Inputs per point of a point encoder (``policies.aed_diffusion.modeling_aed_diffusion.point_features``): 3
    coordinates, +3 the offset from the hand (``relative``), +3 the colour (``color``)."""
    return 3 + 3 * bool(relative) + 3 * bool(color)
