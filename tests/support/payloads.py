"""What a malicious checkpoint could hold, for the safe-loading tests."""


class CreatesFile:
    """Unpickling this creates a file: what a malicious checkpoint could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))
