"""Running segcli with its stderr on a terminal (a pseudo-terminal), and reading the screen."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading


def on_terminal(*args, cwd, columns=250):
    """(exit code, what `python -m segcli ARGS` showed on a terminal `columns` wide as its
    stderr, stdout)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "segcli", *map(str, args)], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    shown = []

    def drain():  # the terminal's buffer is small: read while the command runs
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the command closed the terminal
                return
            if not data:
                return
            shown.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    stdout = process.communicate(timeout=300)[0]
    reader.join(timeout=30)
    os.close(leader)
    return process.returncode, b"".join(shown).decode(), stdout.decode()


def final_screen(shown):
    """The lines a terminal ends up showing: each line's text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in shown.replace("\r\n", "\n").split("\n")]


BAR = re.compile(r"(?P<label>.+): 100%\|.*\| (?P<done>\d+)/(?P<total>\d+) \[[\d:]+<[\d:]+, +"
                 r"[\d.]+(?:(?P<unit>\w+)/s|s/(?P<per>\w+))\]")
"""A finished bar: its label, done of total, and its unit (rates over 1/s) or `per` (under)."""
