"""Commands: (placeholder, filled in by its issue)."""

import click

COMMANDS = []
