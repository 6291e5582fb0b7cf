// Stream a generation from the tokenizer's InferenceService.
//
//   npm install && node client.js --target 127.0.0.1:50051 --prompt "Hello" --max-new-tokens 32
//
// The service definition is loaded at run time from ../../protos, the only definition of the wire;
// nothing is generated or copied. Prints the text as it streams, then one JSON line with meta_info.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

function parseArgs(argv) {
  const args = { target: '127.0.0.1:50051', prompt: 'The capital of France is', maxNewTokens: 32, timeoutS: 60 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (flag === '--target') args.target = value;
    else if (flag === '--prompt') args.prompt = value;
    else if (flag === '--max-new-tokens') args.maxNewTokens = Number(value);
    else if (flag === '--timeout') args.timeoutS = Number(value);
    else throw new Error(`unknown flag ${flag}`);
  }
  return args;
}

function loadApi() {
  const protoRoot = path.resolve(__dirname, '..', '..', 'protos');
  const definition = protoLoader.loadSync(path.join(protoRoot, 'ringserve', 'v1', 'api.proto'), {
    includeDirs: [protoRoot],
    keepCase: true, // field names as written in the .proto (max_new_tokens, meta_info)
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).ringserve.v1;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const api = loadApi();
  const client = new api.InferenceService(args.target, grpc.credentials.createInsecure());
  const request = {
    text: args.prompt,
    sampling_params: { max_new_tokens: args.maxNewTokens, temperature: 0 },
    stream: true,
  };
  const deadline = new Date(Date.now() + args.timeoutS * 1000);
  const call = client.Generate(request, { deadline });
  let text = '';
  call.on('data', (msg) => {
    text += msg.text;
    process.stdout.write(msg.text);
    if (msg.finished) {
      const meta = msg.meta_info;
      process.stdout.write('\n' + JSON.stringify({
        rid: msg.rid,
        text,
        finish_reason: meta.finish_reason ? meta.finish_reason.type : null,
        prompt_tokens: meta.prompt_tokens,
        completion_tokens: meta.completion_tokens,
      }) + '\n');
    }
  });
  call.on('error', (err) => {
    console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on('end', () => client.close());
}

main();
