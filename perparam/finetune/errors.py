"""The one exception type of the main job: bad input the user can fix, reported as one line."""

from __future__ import annotations


class FinetuneInputError(ValueError):
    """Bad user input (missing or corrupt asset, wrong architecture, empty text, impossible sizes).

    The message is one line that says what is wrong and what to do; the CLI prints it as
    ``perparam finetune: error: <message>`` and exits with status 2, without a traceback.
    """
