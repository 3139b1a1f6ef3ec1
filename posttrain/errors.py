"""The one exception type for user mistakes.

A `UserError` is a bad config key, file, row, field or argument. The CLI prints it as one line
(`posttrain: error: ...`) and exits with `exit_code`, never with a traceback.
"""


class UserError(Exception):
    """A mistake in what the user gave us; its message names the file, row, field or argument."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
