// The microphone's AudioWorklet (loaded by audio.js from this server, as the page's
// Content-Security-Policy allows): it mixes each block of the input to mono and hands
// the page about a tenth of a second at a time; "flush" sends what is left, then "done".

const BATCH = 4096;  // frames a message: 128-frame blocks would be hundreds a second

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.buffer = new Float32Array(BATCH);
    this.filled = 0;
    this.port.onmessage = (e) => {
      if (e.data !== "flush") return;
      this.send();
      this.port.postMessage("done");
    };
  }

  send() {
    if (!this.filled) return;
    const out = this.buffer.slice(0, this.filled);
    this.port.postMessage(out, [out.buffer]);
    this.filled = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || !channels.length) return true;  // no input yet: keep listening
    const frames = channels[0].length;
    for (let i = 0; i < frames; i++) {
      let sum = 0;
      for (const channel of channels) sum += channel[i];
      this.buffer[this.filled++] = sum / channels.length;
      if (this.filled === BATCH) this.send();
    }
    return true;
  }
}

registerProcessor("localrt-capture", Capture);
