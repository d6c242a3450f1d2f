"""Grammar-constrained generation from an EBNF grammar: arithmetic expressions.

The grammar (Lark syntax as llguidance reads it; llama.cpp GBNF works too) admits integer
arithmetic with + - * / and parentheses. Each step the matcher's mask goes to the device through a
channel and the epilogue applies it to the logits (`mask_apply`) before taking the best token, so
every token the model writes keeps the text a prefix of a valid expression. When fewer than
`close_within` tokens are left, the inferlet only lets the model finish: a stop token wins as soon
as the grammar allows one, so the expression ends complete.

Input (all optional): "grammar" (default: ARITHMETIC), "prompt", "max_tokens" (default 48),
"close_within" (default 8).
Output: {"text", "complete", "tokens"}, or {"error"} saying what is wrong with the grammar.
"""
from inferlet import HostError, chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          mask_apply, reduce_argmax)
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,6}/
"""


async def main(input: dict) -> dict:
    max_tokens = int(input.get("max_tokens", 48))
    close_within = int(input.get("close_within", 8))
    try:
        matcher = Matcher(Grammar.from_ebnf(input.get("grammar", ARITHMETIC)))
    except HostError as e:                         # a grammar with a syntax error: say where
        return {"error": str(e)}
    vocab = model.output_vocab_size()
    stops = set(chat.stop_tokens())
    prompt = (chat.system("You are a calculator. Reply with one arithmetic expression only.")
              + chat.user(input.get("prompt", "Write an expression that computes the total price of "
                                              "3 books at 12 dollars and 2 pens at 3 dollars."))
              + chat.cue_without_thinking())

    mask_chan = Channel([vocab], dtype.bool)
    ws, pipe = WorkingSet(), Pipeline()
    tokens, feed = [], prompt
    for step in range(max_tokens):
        allowed = unpack_mask(matcher.mask(), vocab)
        if max_tokens - step <= close_within and any(allowed[t] for t in stops):
            break                                  # the expression is complete: end it here
        mask_chan.put(allowed)
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        chosen = fwd.epilogue(lambda: reduce_argmax(mask_apply(intrinsics.output(0, "logits"), mask_chan.take())))
        pipe.submit(fwd)
        token = await chosen
        if not matcher.accept_tokens([token]):
            raise RuntimeError(f"the device chose token {token}, which the grammar does not allow")
        if token in stops or matcher.is_terminated():
            break
        tokens.append(token)
        feed = [token]
    pipe.close()
    allowed = unpack_mask(matcher.mask(), vocab)
    complete = matcher.is_terminated() or any(allowed[t] for t in stops)
    return {"text": model.decode(tokens), "complete": complete, "tokens": len(tokens)}
