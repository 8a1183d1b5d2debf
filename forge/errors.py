"""Errors meant for people: the CLI prints their message as one line, without a traceback."""


class UserError(Exception):
    """Bad input a user can fix (file, config key, path). The message names what and says what to do."""


class DiskFull(UserError):
    """A write the disk refused (no space, a quota, the file-size limit): the message names the path and the bytes
    it needed. The failure path's own bookkeeping writes may meet it too and then stay silent (forge.loop)."""
