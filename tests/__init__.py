"""fleetmind's test suite (a package, so that ``tests.*`` imports resolve here and not to a dependency's own ``tests``
package: draccus 0.11, which LeRobot 0.6 installs, ships one)."""
