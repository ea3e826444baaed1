"""Models behind one interface (base.py); sources.py builds the configured one."""
