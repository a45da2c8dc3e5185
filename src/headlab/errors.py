"""Errors that reach the user as one line and an exit code, never as a traceback."""


class HeadlabError(Exception):
    """A failure the user can act on; the CLI prints the message alone and exits with `exit_code`."""

    exit_code = 1


class UsageError(HeadlabError):
    """Bad input on the command line: unknown model/task/option, malformed override."""

    exit_code = 2
