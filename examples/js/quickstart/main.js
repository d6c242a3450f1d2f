// The quickstart (examples/quickstart/main.py) in JavaScript: a greedy chat reply, one forward
// pass per token, its text streamed as it is decoded.
import { chat, model, session, ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduceArgmax }
  from 'inferlet';

const STOP = new Set(chat.stopTokens());

/** Feed `tokens`, then decode greedily until a stop token. Yields each new token. */
async function* generate(ws, pipe, tokens, maxTokens = 256) {
  for (let i = 0; i < maxTokens; i++) {
    const fwd = new ForwardPass();
    fwd.embed(tokens);
    fwd.state([ws], StateGeometry.folding());
    const next = fwd.epilogue(() => reduceArgmax(intrinsics.output(0, 'logits')));
    pipe.submit(fwd);
    const token = await next;
    if (STOP.has(token)) return;
    yield token;
    tokens = [token];
  }
}

export async function main(input) {
  const prompt = [...chat.system('You are a concise assistant.'),
                  ...chat.user(input.question),
                  ...chat.cueWithoutThinking()];
  const ws = new WorkingSet();
  const pipe = new Pipeline();

  const reply = [];
  let sent = '';
  for await (const token of generate(ws, pipe, prompt)) {
    reply.push(token);
    const text = model.decode(reply);
    session.send(text.slice(sent.length));     // stream the newly decoded text
    sent = text;
  }
  pipe.close();
  return { text: model.decode(reply) };
}
