"""The one exception of the pass's checks: a candidate left alone, its message the reason reported."""


class Reject(Exception):
    """A candidate the pass leaves alone; the message is the reason reported."""
