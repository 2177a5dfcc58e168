"""fleetmind entry points (Hydra apps): `python scripts/<name>.py key=value ...` or `fleetmind <name> key=value ...`."""
