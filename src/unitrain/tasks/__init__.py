"""Training modes, one file each, behind the Task interface (base.py); unitrain/modes.py chooses one."""
