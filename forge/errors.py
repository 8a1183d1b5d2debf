"""Errors meant for people: the CLI prints their message as one line, without a traceback."""


class UserError(Exception):
    """Bad input a user can fix (file, config key, path). The message names what and says what to do."""
