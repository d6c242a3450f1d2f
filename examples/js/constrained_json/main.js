// JSON-schema-constrained generation (examples/constrained_json/main.py) in JavaScript: each step
// the host-side matcher says which tokens may come next, the mask goes into a channel, and the
// epilogue picks the best allowed token (maskedArgmax) next to the logits.
//
// input (all optional): {schema, prompt, system, max_tokens}
//   ->  {text, value (the parsed JSON, or null), complete, tokens}, or {error} for a bad schema
import { HostError, chat, model, Channel, ForwardPass, Grammar, Matcher, Pipeline, StateGeometry, WorkingSet,
         dtype, intrinsics, maskedArgmax, unpackMask } from 'inferlet';

const PERSON = {
  type: 'object', additionalProperties: false, required: ['name', 'age', 'city'],
  properties: { name: { type: 'string', maxLength: 20 },
                age: { type: 'integer', minimum: 0, maximum: 120 },
                city: { type: 'string', maxLength: 20 } },
};

/** JSON text as Python's json.dumps writes it (", " and ": "), so the prompt is the same. */
function pythonJson(value) {
  if (Array.isArray(value)) return `[${value.map(pythonJson).join(', ')}]`;
  if (value !== null && typeof value === 'object') {
    return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${pythonJson(v)}`).join(', ')}}`;
  }
  return JSON.stringify(value);
}

export async function main(input) {
  const schema = input.schema ?? PERSON;
  const maxTokens = Math.trunc(input.max_tokens ?? 128);
  const request = input.prompt ?? 'Describe a fictional person.';
  const prompt = [...chat.system(input.system ?? 'You reply with JSON only.'),
                  ...chat.user(`${request}\nReply with JSON matching this schema: ${pythonJson(schema)}`),
                  ...chat.cueWithoutThinking()];

  let matcher;
  try {
    matcher = new Matcher(Grammar.fromJsonSchema(schema));
  } catch (e) {
    if (e instanceof HostError) return { error: e.message };     // an invalid schema: say why
    throw e;
  }
  const vocab = model.outputVocabSize();
  const stops = new Set(chat.stopTokens());
  const maskChan = new Channel([vocab], dtype.bool);               // host -> device, one mask per pass
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];

  const tokens = [];
  let feed = prompt;
  for (let i = 0; i < maxTokens; i++) {
    maskChan.put(unpackMask(matcher.mask(), vocab));
    const fwd = new ForwardPass();
    fwd.embed(feed);
    fwd.state([ws], StateGeometry.folding());
    const chosen = fwd.epilogue(() => maskedArgmax(intrinsics.output(0, 'logits'), maskChan.take()));
    pipe.submit(fwd);
    const token = await chosen;
    if (!matcher.acceptTokens([token])) {
      throw new Error(`the device chose token ${token}, which the grammar does not allow`);
    }
    if (stops.has(token)) break;
    tokens.push(token);
    feed = [token];
    if (matcher.isTerminated()) break;
  }
  pipe.close();

  const text = model.decode(tokens);
  const complete = matcher.isTerminated();
  return { text, value: complete ? JSON.parse(text) : null, complete, tokens: tokens.length };
}
