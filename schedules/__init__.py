"""schedules package."""
