"""What a person did wrong or must fix, said in one line, with one exit code per kind.

The shell raises a :class:`UserError` where it finds a problem the person running the
command can fix (a configuration file, a broker address, a kubeconfig, a port); the
``vmstream`` command catches it once (streams/common/dispatch.py, for every subcommand) and prints
``vmstream <command>: <what is wrong> — <what to do>`` to stderr instead of a traceback.
A bug still shows its traceback: only what is raised as a :class:`UserError` is shortened.

The exit codes are the CLI's contract (docs/cli.md, "Exit codes", and ``vmstream --help``).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # refused, not accepted, a difference found: the command ran and says no
EXIT_USAGE = 2  # bad arguments or configuration (argparse uses 2 too)
EXIT_TIMEOUT = 3  # ``tail``, ``intent --wait``: not done within --timeout
EXIT_KAFKA = 4  # the broker is unreachable, refuses us, or the topics are missing
EXIT_COMMAND_FAILED = 5  # ``intent --wait``: accepted, but a command failed in Kubernetes
EXIT_KUBERNETES = 6  # no usable kubeconfig, or the API server is unreachable
EXIT_PORT = 7  # a port to listen on is taken
EXIT_PUBLISH = 75  # the worker: a message refused past its retries (EX_TEMPFAIL), docs/worker.md
EXIT_INTERRUPTED = 130  # SIGINT

EXIT_CODES_HELP = (
    "exit codes: 0 ok; 1 failed or refused (replay: a difference; intent: not accepted); "
    "2 bad arguments or configuration; 3 timed out (tail, intent --wait); 4 Kafka unreachable "
    "or topics missing; 5 a command failed in Kubernetes (intent --wait); 6 no usable kubeconfig "
    "or Kubernetes API unreachable; 7 a port to listen on is in use; 75 the worker could not "
    "publish (docs/worker.md); 130 interrupted"
)


class UserError(Exception):
    """A problem the person running the command fixes: ``message`` says what is wrong,
    ``hint`` what to do; ``exit_code`` is the documented status."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, hint: str = "", *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def line(self, command: str | None) -> str:
        """The one line printed: ``vmstream <command>: <message> — <hint>``."""
        prefix = f"vmstream {command}" if command else "vmstream"
        text = " ".join(self.message.split())  # one line, whatever the cause's text held
        return f"{prefix}: {text} — {self.hint}" if self.hint else f"{prefix}: {text}"


class ConfigError(UserError):
    """The configuration file is missing, not YAML, or does not fit the schema."""

    exit_code = EXIT_USAGE


class KafkaUnreachable(UserError):
    """No broker answered at the configured bootstrap servers within the start-up bound."""

    exit_code = EXIT_KAFKA


class KubernetesUnavailable(UserError):
    """No usable kubeconfig, or the API server it names does not answer."""

    exit_code = EXIT_KUBERNETES


class PortInUse(UserError):
    """A port the process must listen on is taken by another process."""

    exit_code = EXIT_PORT
