"""One exception hierarchy for the whole project: every message says what happened and what to do."""


class ArtSkyError(Exception):
    """Base class of every error art-sky raises on purpose."""


class ConfigError(ArtSkyError):
    """A setting, argument or input is wrong; the message names it."""


class ServerError(ArtSkyError):
    """The cluster server answered with an error (status code and its message)."""

    def __init__(self, status_code: int, message: str):
        super().__init__(f"server said {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class AuthError(ServerError):
    """Wrong or missing API key."""


class NotFoundError(ServerError):
    """Unknown model, step or route."""


class VersionMismatchError(ArtSkyError):
    """Client and cluster server run different art-sky versions."""


class BackendUnavailableError(ArtSkyError):
    """The server could not be started or reached (dead process, dead tunnel, timeout)."""


class EngineError(ArtSkyError):
    """The inference engine failed (vLLM did not start, refused an adapter); the message points at its log."""


class SSHError(BackendUnavailableError):
    """An SSH connection, login, remote command or file transfer failed."""


class DiskFullError(ArtSkyError):
    """A write ran out of disk space (whatever layer raised it: art_sky/disk_full.py); the message names the disk
    and what to free."""


class TokenizationError(ArtSkyError):
    """A trajectory cannot be turned into training tokens (e.g. a choice without sampled token ids)."""


class CheckpointStoreError(ArtSkyError):
    """The checkpoint object store refused or failed an operation; the message names the store's URI."""


class TrainingStalledError(ArtSkyError):
    """A training step made no progress for longer than ART_SKY_TRAIN_STALL_TIMEOUT; the message says what the server
    was doing (the phase it is stuck in)."""
