// A replacement chat endpoint for `pie serve`, written in JavaScript (examples/serve_endpoint/main.py
// is the same program in Python): every API's chat route answers through it.
//
//     # $PIE_HOME/config.toml
//     [serve.routes]
//     "/v1/chat/completions" = "examples/js/serve_endpoint/main.js"
//
// It receives the neutral input of the built-in endpoint (pie_actors/serve/endpoints/chat.py, whose
// docstring is the whole protocol) and speaks the same messages: the conversation's last user
// message, answered greedily in the voice of a ship's captain, streamed as text, with the usage
// the APIs report.
//
// input: {messages, max_tokens, stream, ...}  ->  {choices: [{index, text, finish_reason}], usage}
import { chat, model, session, Pipeline, WorkingSet, generate } from 'inferlet';

const SYSTEM = 'You are the captain of a sailing ship. Answer in one sentence.';
const STOP = chat.stopTokens();

export async function main(input) {
  const question = input.messages.findLast((m) => m.role === 'user').content;
  const prompt = [...chat.system(SYSTEM), ...chat.user(question), ...chat.cueWithoutThinking()];
  const maxTokens = Math.min(input.max_tokens || 256, model.maxPosition() - prompt.length);
  const streaming = input.stream ?? true;
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];
  if (streaming) session.send({ type: 'start', prompt_tokens: prompt.length, cached_tokens: 0 });

  const reply = [];
  let sent = '';
  for await (const token of generate(ws, pipe, prompt, maxTokens, STOP)) {
    reply.push(token);
    const text = model.decode(reply);
    if (streaming && !text.endsWith('\ufffd')) {            // a whole character at least
      session.send({ type: 'text', choice: 0, text: text.slice(sent.length) });
      sent = text;
    }
  }
  pipe.close();
  const text = model.decode(reply);
  const reason = reply.length >= maxTokens ? 'length' : 'stop';
  if (streaming) {
    session.send({ type: 'text', choice: 0, text: text.slice(sent.length) });
    session.send({ type: 'finish', choice: 0, reason });
  }
  return { choices: [{ index: 0, text, finish_reason: reason }],
           usage: { prompt_tokens: prompt.length, completion_tokens: reply.length, cached_tokens: 0 } };
}
