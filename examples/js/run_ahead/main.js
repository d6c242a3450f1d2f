// Loop-carried decoding on the device (examples/run_ahead/main.py in JavaScript): one decode pass
// repeats on the engine, its epilogue putting each token into the next run's input channel and
// into a channel the host reads; pipe.runAhead keeps it in flight, the program woken once per
// window's tokens. The tokens are those of one-pass-per-token greedy decoding.
//
// input: {prompt, max_tokens}  ->  {text, tokens}
import { chat, model, Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics, reduceArgmax,
         reshape } from 'inferlet';

const greedy = () => reduceArgmax(intrinsics.output(0, 'logits'));

export async function main(input) {
  const prompt = [...chat.prefix(), ...model.encode(input.prompt ?? 'The capital of France is')];
  const maxTokens = Math.trunc(input.max_tokens ?? 32);
  const stop = new Set(chat.stopTokens());
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];

  const first = new ForwardPass();
  first.embed(prompt);
  first.state([ws], StateGeometry.folding());
  const token = first.epilogue(greedy);
  pipe.submit(first);
  const tokens = [await token];

  const tokenIn = Channel.from([tokens[0]], dtype.i32);             // the decode pass's input
  const tokenOut = new Channel([1], dtype.i32).capacity(model.channelCapacity());
  const step = new ForwardPass();
  step.embed(tokenIn, Channel.from([0, 1], dtype.u32));
  step.state([ws], StateGeometry.folding());
  step.epilogue(() => {
    const chosen = reshape(greedy(), [1]);
    tokenIn.put(chosen);          // device -> device: the next run's input
    tokenOut.put(chosen);         // device -> host
  });

  const onToken = async () => {
    tokens.push(await tokenOut.takeScalar());
    return !stop.has(tokens[tokens.length - 1]) && tokens.length < maxTokens;
  };
  if (!stop.has(tokens[0]) && maxTokens > 1) {
    await pipe.runAhead(step, maxTokens - 1, onToken, model.runAheadWindow());
  }
  pipe.close();
  if (stop.has(tokens[tokens.length - 1])) tokens.pop();
  return { text: model.decode(tokens), tokens };
}
