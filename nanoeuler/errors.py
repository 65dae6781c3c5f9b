"""The one exception type for problems the user can fix (bad input, bad config, missing files).

The CLI prints it as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A clear, one-line message naming the file/key/record and what is wrong."""


def check_text(text: str, what: str) -> str:
    """`text` when it is valid Unicode that UTF-8 can hold; else a UserError naming `what` and the culprit.

    Command-line arguments and terminal lines that are not valid UTF-8 reach Python as lone surrogates
    (U+DC80-U+DCFF stand for the undecodable bytes), which no encoder takes.

        >>> check_text("caf\\udce9", "--prompt")
        Traceback (most recent call last):
        nanoeuler.errors.UserError: --prompt is not valid UTF-8 text (at character 3: the byte 0xe9)
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        bad = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise UserError(f"{what} is not valid UTF-8 text (at character {exc.start}: {bad})") from None
    return text
