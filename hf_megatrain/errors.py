"""The one exception type users see for bad input or an impossible request."""


class MegaTrainError(ValueError):
    """Raised with a message that says what is wrong and what to do about it."""
