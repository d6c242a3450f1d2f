// Top-a sampling (examples/top_a/main.py) in JavaScript: keep the tokens whose probability is at
// least a * p_max^2 and sample among them with gumbelMax, the whole function traced into one
// device program (the same IR bytes as the Python one). The seed of each step is put into a
// channel by the host and taken by the epilogue, so a seed gives the Python original's tokens.
//
// input: {prompt, max_tokens, a, seed}  ->  {text, tokens}
import { chat, model, Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, broadcast, dtype, float, ge,
         gumbelMax, intrinsics, mul, reduceMax, select, softmax } from 'inferlet';

function topA(logits, vocab, a, rng) {
  const probs = softmax(logits);
  const pMax = reduceMax(probs);
  const keep = ge(probs, broadcast(mul(a, pMax).mul(pMax), [vocab]));
  const masked = select(keep, logits, broadcast(float(-Infinity), [vocab]));
  return gumbelMax(masked, rng);
}

export async function main(input) {
  const tokens = [...chat.prefix(), ...model.encode(input.prompt ?? 'Once upon a time')];
  // `a` is a float in Python's IR even when it is whole (1 -> 1.0): float() says so
  const [maxTokens, a, seed] = [Math.trunc(input.max_tokens ?? 16), float(input.a ?? 0.2), Math.trunc(input.seed ?? 0)];
  const vocab = model.outputVocabSize();
  const stop = new Set(chat.stopTokens());
  const rng = new Channel([1], dtype.i64);
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];

  const out = [];
  let feed = tokens;
  for (let step = 0; step < maxTokens; step++) {
    rng.put([seed * 1_000_000 + step]);
    const fwd = new ForwardPass();
    fwd.embed(feed);
    fwd.state([ws], StateGeometry.folding());
    const token = fwd.epilogue(() => topA(intrinsics.output(0, 'logits'), vocab, a, rng.take()));
    pipe.submit(fwd);
    out.push(await token);
    if (stop.has(out[out.length - 1])) {
      out.pop();
      break;
    }
    feed = out.slice(-1);
  }
  pipe.close();
  return { text: model.decode(out), tokens: out };
}
