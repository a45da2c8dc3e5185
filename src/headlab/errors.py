"""Errors that reach the user as one line and an exit code, never as a traceback."""


class HeadlabError(Exception):
    """A failure the user can act on; the CLI prints the message alone and exits with `exit_code`."""

    exit_code = 1


class UsageError(HeadlabError):
    """Bad input on the command line: unknown model/task/option, malformed override."""

    exit_code = 2


class Interrupted(BaseException):
    """A signal asked the command to stop: Ctrl-C's SIGINT or a scheduler's SIGTERM (the CLI's handler raises it).

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (a job's, Hydra's, a
    launcher's) takes it for a failed job and goes on; not a KeyboardInterrupt, which typer turns into an exit
    code that standalone_mode=False returns instead of raising, with the signal's name lost."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        how = "interrupted" if signum == signal.SIGINT else "terminated"
        super().__init__(f"{how} ({signal.Signals(signum).name})")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal itself ended
