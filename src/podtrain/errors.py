"""User-facing errors: one line, exit code 2, no traceback (bugs keep theirs)."""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A mistake the user can fix (bad config key, missing file, wrong flag).

    The CLI prints ``podtrain: error: <message>`` on one line and exits with code 2. The message
    must name the culprit: the file, the config key, the rank or the host.
    """

    exit_code = USER_ERROR_EXIT_CODE
