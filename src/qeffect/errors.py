"""User-facing errors: bad input that the command line reports in one line with exit code 2."""


class UserError(Exception):
    """Bad input from the user (a file, a field, an option). The CLI prints it in one line, exit 2."""

    exit_code = 2


class ReportError(Exception):
    """Unreadable artifact (corrupt checkpoint, unknown schema). The CLI prints it in one line, exit 1."""

    exit_code = 1
