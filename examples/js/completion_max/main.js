// Greedy completion, one forward pass per token (examples/completion_max/main.py in JavaScript).
//
// input: {prompt, max_tokens}  ->  {text}
import { chat, model, ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduceArgmax } from 'inferlet';

export async function main(input) {
  const tokens = [...chat.prefix(), ...model.encode(input.prompt ?? 'The capital of France is')];
  const maxTokens = Math.trunc(input.max_tokens ?? 8);
  const ws = new WorkingSet();     // the sequence's state, whatever the model keeps
  const pipe = new Pipeline();

  let done = 0;                    // tokens already in the working set
  for (let i = 0; i < maxTokens; i++) {
    const fwd = new ForwardPass();
    fwd.embed(tokens.slice(done));                     // the new tokens
    fwd.state([ws], StateGeometry.folding());          // appended, and final
    const out = fwd.epilogue(() => reduceArgmax(intrinsics.output(0, 'logits')));   // runs on the device
    pipe.submit(fwd);
    done = tokens.length;
    tokens.push(await out);
  }
  pipe.close();
  return { text: model.decode(tokens.slice(-maxTokens)) };
}
