"""The command line: ``tierstore serve | stat | config | demo | route | router``.

``main`` builds the parser and runs a command; ``route`` adds the router's
commands; ``demo`` is the two-host demo.
"""

from tierstore.cli.main import main

__all__ = ["main"]
