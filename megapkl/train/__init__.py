"""The RL train loop, protocol schedules, logging and plots."""
