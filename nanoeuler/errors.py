"""The one exception type for problems the user can fix (bad input, bad config, missing files).

The CLI prints it as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A clear, one-line message naming the file/key/record and what is wrong."""
