"""What a malicious checkpoint could hold, and a local web server to serve it from."""
import builtins
import contextlib
import functools
import http.server
import os
import threading
from pathlib import Path
from typing import Iterator


class CreatesFile:
    """Unpickling this creates a file: what a malicious checkpoint could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


class RunsCommand:
    """Unpickling this runs a shell command (``os.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class CallsEval:
    """Unpickling this evaluates Python code (``builtins.eval``)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (builtins.eval, (self.code,))


class Plain:
    """An instance of a class ``weights_only`` loading does not know (GLOBAL, then BUILD)."""

    def __init__(self) -> None:
        self.value = 1


@contextlib.contextmanager
def serving(directory: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` serving ``directory`` from a thread (a free port)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        timeout = 30  # a stalled request ends

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ('127.0.0.1', 0), functools.partial(Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.1),
                              daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
