"""Every failure a user can cause or meet is a CachemgrError; the CLI turns it into one line."""

from __future__ import annotations


class CachemgrError(Exception):
    """Base class: a message for people and the process exit code."""

    exit_code = 1


class UsageError(CachemgrError):
    """A bad value on the command line or in a config file."""

    exit_code = 2


class ConfigError(UsageError):
    pass


class NotFound(CachemgrError):
    """A key, model or file the user named does not exist."""

    exit_code = 3


class CacheDirError(CachemgrError):
    """The cache directory is missing, not a directory, or unreadable."""

    exit_code = 4


class DatabaseError(CachemgrError):
    """The index database cannot be opened, migrated or reached."""

    exit_code = 5


class RemoteError(CachemgrError):
    """The remote (Redis) tier cannot be reached or refused us."""

    exit_code = 6


class UnsafePath(CachemgrError):
    """A path would leave the cache root: never touched."""

    exit_code = 7


class PrewarmError(CachemgrError):
    """One or more shapes failed or missed during prewarm / verify."""

    exit_code = 8


class AlreadyRunning(CachemgrError):
    """Another cachemgr daemon already serves this cache directory or index."""

    exit_code = 10
