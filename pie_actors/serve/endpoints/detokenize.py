"""The built-in /detokenize endpoint: {"tokens": [token ids]} -> {"prompt": their text}, or
{"error": {...}} for ids that are not the model's."""
from inferlet import HostError, model


def refuse(message: str) -> dict:
    return {"error": {"type": "invalid_request", "message": message, "param": "tokens"}}


async def main(input: dict) -> dict:
    tokens = input.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return refuse("tokens must be a list of token ids")
    try:
        return {"prompt": model.decode(tokens)}
    except HostError as e:
        return refuse(str(e).removeprefix("model.decode: "))
