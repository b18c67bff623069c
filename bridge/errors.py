"""Exception type for checkpoint problems."""


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, unreadable or does not match the model.

    Messages name the file, the tensor and the fix.
    """
