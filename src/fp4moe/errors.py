"""The errors a user can cause: the CLI prints them as one line and exits 2, with nothing written. This module
imports nothing: every layer's own error (a bad checkpoint, prompt, image, model, calibration set or
quantization) derives from ``UserError`` where it is raised."""


class UserError(Exception):
    """Bad input or an unsound checkpoint, reported to the user in one line (never a stack trace)."""


# what the CLI reports as a user's error: ours, invalid values, and paths that are missing or in the way
USER_ERRORS = (UserError, ValueError, FileExistsError, FileNotFoundError, NotADirectoryError)
