// Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011): the
// counter-based generator behind CUDA's and the SUPA cards' random operators. One call maps a
// 128-bit counter and a 64-bit key to four independent 32-bit words; nothing else is stored.
#pragma once

#include <cstdint>

namespace supa::philox {

struct Words {
  uint32_t w[4];
};

// The counter of element group `group` (an operator's element i belongs to group offset/4 + i/4
// and reads lane i % 4) for its `draw`-th word per element: the group in the low 64 bits, the
// draw in the third word, so extra draws never meet another call's counters.
inline Words philox4x32_10(uint64_t group, uint32_t draw, uint64_t seed) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32), c2 = draw, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// Uniform floats from one word: 24 random bits, in [0, 1), or with `open` (half a step added) in (0, 1).
inline float unit_float(uint32_t word, bool open = false) {
  return (static_cast<float>(word >> 8) + (open ? 0.5f : 0.0f)) * (1.0f / 16777216.0f);
}
// Uniform doubles from two words: 53 random bits, likewise.
inline double unit_double(uint32_t high, uint32_t low, bool open = false) {
  const uint64_t bits = (static_cast<uint64_t>(high) << 21) ^ (low >> 11);
  return (static_cast<double>(bits) + (open ? 0.5 : 0.0)) * (1.0 / 9007199254740992.0);
}

}  // namespace supa::philox
