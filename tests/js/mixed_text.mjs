// A deterministic mixed-script text for tokenizer tests and benches: English, code, CJK,
// Cyrillic, Arabic, Hebrew, Devanagari, Thai, emoji (ZWJ, flags, skin tones), combining marks,
// odd whitespace, special-token strings ("<s>", "<start_of_turn>", "<|endoftext|>") and
// characters no vocabulary has (private use, CJK extension B), in a seeded random order.
function mulberry32(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const fragments = [
  'The quick brown fox jumps over the lazy dog. ',
  "I don't think we'll make it; they've said it's fine, haven't they? ",
  'Tokenizers split text into pieces; byte fallback covers every character. ',
  '    def encode(self, text: str) -> list[int]:\n        return [self.vocab[t] for t in text.split()]\n',
  'for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n',
  'std::vector<std::pair<int, float>> v{{1, 2.5f}}; if (a<b && c>d) return x<<2;\n',
  'const f = async (x) => { await fetch(`/api/${x}`); };  // arrow\n',
  '<div class="a"><span>text</span></div> <table><tr><td>1</td></tr></table>',
  '数据科学是一门跨学科的领域，它使用科学方法、过程、算法和系统。',
  '日本語のテキストとカタカナ、ひらがな。東京は大きい都市です。',
  '한국어 문장입니다. 안녕하세요, 세계!',
  'Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.',
  'مرحبا بالعالم، هذا نص عربي للاختبار.',
  'שלום עולם, זה טקסט בעברית.',
  'नमस्ते दुनिया, यह हिंदी में पाठ है।',
  'สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง',
  'Ελληνικά: γειά σου κόσμε. ',
  '🤗🚀👍🏽 👨‍👩‍👧 🇫🇷🇯🇵 ❤️✨🎉',
  'e\u0301 a\u0308\u0323 Cafe\u0301 Z\u0324\u0354\u0367\u0311\u0313 n\u0303o\u0302',
  'naïve café résumé Ångström façade coöperate',
  '  ', '\t\t', '\n\n\n', ' \n ', '\r\n', '\u00a0', '\u3000', '\u2009x\u200b', '\n    leading spaces',
  '<s>', '</s>', '<unk>', '<bos>', '<eos>', '<pad>', '<start_of_turn>user\n', '<end_of_turn>\n',
  '<|endoftext|>', '<|endofprompt|>', '<unused12>', '<mask>', '[multimodal]', '<0x0A>', '▁', '▁▁▁ ▁x',
  '<s>word', 'word</s>', '<s><s>', ' <s> ', '<start_of_turn>model\nHi<end_of_turn>',
  '\ue000\ue001 private use', '𠀀𪚥 ext-B', '𓀀𓁐 hieroglyphs', 'bell\u0007 esc\u001b[0m',
  '1234567890 3.14159 1,000,000 0x1F 2024-01-31T12:00:00Z',
  'a'.repeat(300), 'ab'.repeat(120), '—'.repeat(40), ' '.repeat(33), '\n'.repeat(12), '\t'.repeat(9),
];
const separators = ['', ' ', ' ', ' ', '  ', '\n', '\t', '\n\n'];

export function mixedText(minBytes) {
  const rand = mulberry32(20240531);
  let text = '';
  let longRun = '';  // one stretch of 20 kB with no special-token strings (one long BPE word)
  for (let i = 0; Buffer.byteLength(longRun) < 20000; ++i) longRun += fragments[i % 20] + separators[i % 8];
  while (Buffer.byteLength(text) < minBytes) {
    text += fragments[Math.floor(rand() * fragments.length)] + separators[Math.floor(rand() * separators.length)];
    if (text.length > 40000 && !text.includes(longRun)) text += longRun;
  }
  return '   ' + text;  // leading spaces
}

