// Clips for a model that hears: the microphone recorded into a 16-bit PCM WAV made
// here (no other site, no library), and audio files told apart by their bytes as the
// server tells them (WAV, MP3, FLAC), each kept as a data: URL like an attached image.

const RATE = 16000;  // what the audio projectors' preprocessors resample every clip to
// A format's data: URL media type; the server checks the bytes, the page only labels.
const MEDIA = { wav: "audio/wav", mp3: "audio/mpeg", flac: "audio/flac" };

// "wav", "mp3" or "flac" by a file's first bytes (a Uint8Array), or null; the same
// signatures as the server's localrt.engines.audio.format_of.
export function sniff(b) {
  const text = (from, to) => String.fromCharCode(...b.subarray(from, to));
  if (b.length >= 12 && text(0, 4) === "RIFF" && text(8, 12) === "WAVE") return "wav";
  if (text(0, 4) === "fLaC") return "flac";
  if (text(0, 3) === "ID3" || (b.length >= 4 && b[0] === 0xff && (b[1] & 0xe0) === 0xe0)) {
    return "mp3";
  }
  return null;
}

// The format of a clip's data: URL, as an input_audio part names it.
export function formatOf(url) {
  const type = url.slice(5, url.indexOf(";"));
  return Object.keys(MEDIA).find((f) => MEDIA[f] === type) || "wav";
}

// The base64 data of a data: URL (what an input_audio part carries).
export function base64Of(url) {
  return url.slice(url.indexOf(",") + 1);
}

// A Blob of a clip's bytes (a Uint8Array, or a chosen File), labelled with its format's
// media type.
export function blob(bytes, format) {
  return new Blob([bytes], { type: MEDIA[format] });
}

// A blob: URL to play a clip's data: URL in an <audio> element: the page's policy lets
// media come from blob: URLs, which only the page's own script can make, not data: ones.
export function playable(url) {
  const bytes = Uint8Array.from(atob(base64Of(url)), (c) => c.charCodeAt(0));
  return URL.createObjectURL(new Blob([bytes], { type: url.slice(5, url.indexOf(";")) }));
}

// 16-bit PCM mono WAV bytes of samples in [-1, 1] at `rate` Hz.
export function wav(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const put = (at, text) => [...text].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  put(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  put(8, "WAVE");
  put(12, "fmt ");
  view.setUint32(16, 16, true);          // the fmt chunk's size
  view.setUint16(20, 1, true);           // PCM
  view.setUint16(22, 1, true);           // one channel
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true);    // bytes a second
  view.setUint16(32, 2, true);           // bytes a frame
  view.setUint16(34, 16, true);          // bits a sample
  put(36, "data");
  view.setUint32(40, samples.length * 2, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Uint8Array(view.buffer);
}

// The samples at RATE Hz, resampled by the browser's own (band-limited) resampler.
async function resample(samples, rate) {
  if (rate === RATE) return samples;
  const offline = new OfflineAudioContext(1, Math.ceil(samples.length * RATE / rate), RATE);
  const buffer = offline.createBuffer(1, samples.length, rate);
  buffer.copyToChannel(samples, 0);
  const source = offline.createBufferSource();
  source.buffer = buffer;
  source.connect(offline.destination);
  source.start();
  return (await offline.startRendering()).getChannelData(0);
}

// One recording from the microphone: start() asks for it (the browser's prompt comes
// now, never when the page loads), stop() gives the WAV bytes and lets it go.
export class Recorder {
  constructor() {
    this.blocks = [];
    this.frames = 0;
    this.context = null;
    this.stream = null;
  }

  async start() {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia ||
        typeof AudioWorkletNode === "undefined") {
      throw new Error("This browser gives the microphone only to a secure page: " +
                      "open the page as http://127.0.0.1 or localhost, or over https");
    }
    try {
      // Made in the press's own turn, where the browser lets a page start its audio.
      this.context = new AudioContext();
      // The signal as the microphone hears it: the processing meant for calls (noise
      // suppression, gain control, echo cancelling) alters what a speech model hears.
      this.stream = await navigator.mediaDevices.getUserMedia({ audio: {
        noiseSuppression: false, autoGainControl: false, echoCancellation: false } });
      await this.context.audioWorklet.addModule("/web/capture.js");
      this.node = new AudioWorkletNode(this.context, "localrt-capture");
      this.done = new Promise((resolve) => {
        this.node.port.onmessage = (e) => {
          if (e.data === "done") resolve();
          else {
            this.blocks.push(e.data);
            this.frames += e.data.length;
          }
        };
      });
      this.context.createMediaStreamSource(this.stream).connect(this.node);
      // The graph runs only toward the speakers; the node writes silence there.
      this.node.connect(this.context.destination);
      await this.context.resume();
    } catch (e) {
      this.release();
      throw e;
    }
  }

  // Seconds recorded so far.
  get seconds() {
    return this.context ? this.frames / this.context.sampleRate : 0;
  }

  // The recording as 16-bit PCM WAV bytes at 16 kHz; null when nothing was recorded.
  async stop() {
    this.stream.getTracks().forEach((t) => t.stop());
    this.node.port.postMessage("flush");
    // A worklet that never answers (a context that could not run) must not keep the
    // button waiting: what came so far is the recording.
    await Promise.race([this.done, new Promise((resolve) => setTimeout(resolve, 2000))]);
    const rate = this.context.sampleRate;
    this.release();
    if (!this.frames) return null;
    const all = new Float32Array(this.frames);
    let at = 0;
    for (const block of this.blocks) {
      all.set(block, at);
      at += block.length;
    }
    return wav(await resample(all, rate), RATE);
  }

  // Let the microphone and the audio graph go (after stop, or a failed start).
  release() {
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.context) this.context.close().catch(() => {});
  }
}
