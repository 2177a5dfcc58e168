"""Tests that need the [lerobot] extra (LeRobot 0.6.1)."""
