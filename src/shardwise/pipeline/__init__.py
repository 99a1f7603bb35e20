"""Pipeline parallelism: schedules as data (actions, schedules), checked and simulated without processes."""
