"""tests/with_lerobot: import LeRobot before anything imports ``sim``.

``import lerobot.robots`` pulls torchvision -> torch._dynamo -> triton. On a machine whose EGL is Mesa's
(llvmpipe), ``sim`` probes EGL at import (loading Mesa's libLLVM); loading triton's libtriton after that segfaults
the process, while the other order works (see fleet/deploy/so100_sim_robot/__init__.py). Without LeRobot this does
nothing and the tests here skip themselves.
"""

try:
    import lerobot.robots  # noqa: F401
except ImportError:
    pass
