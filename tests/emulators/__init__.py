"""The emulators and generators the tests and benchmarks run against, one module each:

- `hubemu`: a Hugging Face-compatible hub and its CDN (`HubEmulator`);
- `pkgindex`: a PEP 503/691 package index (`PackageIndex`);
- `loopback`: the listening side hubemu and pkgindex share;
- `proxyfix`: real forward proxies (proxy.py, tinyproxy) and TLS targets;
- `upstreams`: llama-cpp-python's own server as a remote model's upstream;
- `ggufgen`: tiny GGUF models (`write_gguf`, `write_bert_gguf`);
- `onnxgen`: tiny onnxruntime-genai models (`write_onnx_model`);
- `chattemplates`: real models' chat templates and their added tokens;
- `enginepkg`: engine wheels built on the fly (`build_wheel`, `build_echo_engine_wheel`).

Not test modules. Tests import them as `from emulators.hubemu import HubEmulator`: tests/
is on sys.path under pytest, and the benchmarks in tests/bench put it there.
"""
