"""Weaver's one error type. Messages are one line naming the file/field/stage and what is missing, so the CLI can
print them without a traceback (it may catch `PlanError` beside `forge.errors.UserError`; weaver does not import forge)."""


class PlanError(ValueError):
    """Pools or stage needs that cannot be planned, or a malformed pool/plan declaration. `stage`: the stage that
    could not be placed, where one is to blame (the caller may name the setting that asked for it)."""

    def __init__(self, message: str, stage: str = ""):
        super().__init__(message)
        self.stage = stage
