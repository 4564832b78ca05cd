from rlfw.cli import entry

entry()
