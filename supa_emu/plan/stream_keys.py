"""The time model's stream keys, (device, stream): a card's streams by their number, a communicator's
own stream (where its asynchronous collectives run) by a name.
"""


def communicator_stream(communicator: str) -> str:
    """The stream key (beside the card's stream numbers) of a communicator's own stream."""
    return f"bccl {communicator}"


def is_communicator_stream(stream) -> bool:
    """Whether a stream key (the second half of a (device, stream) key) is a communicator's own stream:
    card streams are numbers, communicator_stream's keys are names."""
    return isinstance(stream, str)
