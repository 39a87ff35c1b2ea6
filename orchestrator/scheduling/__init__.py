"""Schedules: the slots a cron expression or an interval gives in a time zone (``calendar``),
and which of them a scheduler fires, skips or leaves for later (``plan``)."""
