"""Recurring tasks: a schedule's declaration and stored state (``model``), its recurrence
(cron or interval ticks, ``recurrence``) and the worker side task that fires them
(``scheduler``). What users name (``Schedule``, ``ScheduleState``, ``ScheduleView``) is
exported by ``taskrunner``; the rest is internal and may change."""
