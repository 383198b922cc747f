"""``python -m launcher`` is ``ftlaunch``."""

from launcher.cli import main

main()
