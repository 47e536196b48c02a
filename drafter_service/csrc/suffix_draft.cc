// Speculation over a SuffixTree (mirrors drafter_service/suffix_draft.py and SuffixTree.speculate).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "suffix_tree.h"

namespace speclane {

namespace {

// The most a draft from a match of `match_len` tokens may hold.
int budget_for(const SpecParams& params, size_t match_len) {
  double limit = std::floor(params.max_spec_factor * static_cast<double>(match_len) + params.max_spec_offset);
  return limit < params.max_spec_tokens ? static_cast<int>(std::max(limit, -1.0)) : params.max_spec_tokens;
}

}  // namespace

Draft SuffixTree::speculate(const int32_t* context, size_t n, const SpecParams& params,
                            const Sequence* along) const {
  if (params.max_spec_factor < 0) throw std::invalid_argument("max_spec_factor must be >= 0");
  // Every suffix of a running sequence ends on a known node (up to max_depth
  // tokens): for the match lengths m the context shares with `along`'s tail,
  // the position is known without a walk from the root.
  size_t known = 0;
  if (along != nullptr && !along->frontier.empty()) {
    const std::vector<int32_t>& tokens = stores_[along->store].tokens;
    const size_t limit = std::min(n, along->suffixes() - 1 + (full_node(*along) != kNone));
    const int32_t* tail = tokens.data() + tokens.size();
    while (known < limit && context[n - 1 - known] == tail[-1 - static_cast<std::ptrdiff_t>(known)]) ++known;
  }
  auto known_position = [&](size_t match_len) {
    uint32_t node = match_len < along->suffixes() ? along->node_of(match_len) : along->full;
    return Position{node, length_of(nodes_[node])};
  };
  // The trie holds every substring of a stored pattern, so the matching tail
  // lengths are 1..longest: a binary search finds the longest in O(depth log depth).
  size_t longest = known, too_long = std::min(n, static_cast<size_t>(max_depth_)) + 1;
  Position at, longest_at;
  if (known > 0) longest_at = known_position(known);
  while (too_long - longest > 1) {
    size_t middle = (longest + too_long) / 2;
    if (match(context, n - middle, n, &at)) {
      longest = middle;
      longest_at = at;
    } else {
      too_long = middle;
    }
  }
  // Known lengths from `once` up end on open leaves: patterns seen once.
  size_t once = SIZE_MAX;
  if (known > 0) {
    once = along->frontier.size();
    while (once < along->suffixes() && nodes_[along->node_of(once)].length != kOpen) ++once;  // joined since
  }
  Draft best;
  Position best_at;
  int best_budget = 0;
  int32_t drafted_count = 0;
  for (size_t match_len = longest; match_len > 0; --match_len) {
    const int budget = budget_for(params, match_len);
    // A score never exceeds its budget, which only shrinks from here: at best a tie.
    if (match_len < longest && budget <= best.score) break;
    if (match_len == longest) {
      at = longest_at;
    } else if (match_len <= known) {
      if (drafted_count == 1 && match_len >= once) {  // a run of the same count as the draft: all skipped
        match_len = once;
        continue;
      }
      at = known_position(match_len);
    } else {
      match(context, n - match_len, n, &at);
    }
    // The same occurrences as a longer match, with a smaller budget: skipped.
    if (nodes_[at.node].count == drafted_count) continue;
    drafted_count = nodes_[at.node].count;
    Draft draft = params.use_tree ? draft_tree(at, budget, params.min_token_prob)
                                  : draft_path(at, budget, params, context + n - match_len, match_len);
    draft.match_len = static_cast<int>(match_len);
    if (match_len == longest || draft.score > best.score) {
      best = std::move(draft);
      best_at = at;
      best_budget = budget;
    }
  }
  const int drafted = static_cast<int>(best.token_ids.size());
  if (params.lookahead > 0 && !params.use_tree && drafted > 0) {
    const size_t m = static_cast<size_t>(best.match_len);
    const int32_t* pattern = context + n - m;
    // Cut by its budget, not by the path: the step after, should this one be accepted whole and the
    // target's next token be the path's, matches drafted + 1 tokens more, so its budget is larger.
    const int next_budget = budget_for(params, m + static_cast<size_t>(drafted) + 1);
    const int more = drafted == best_budget ? std::min(params.lookahead, 1 + std::max(0, next_budget)) : 0;
    std::vector<Position> visited;
    Draft walked = draft_path(best_at, drafted + more, params, pattern, m, &visited);
    if (more > 0) {
      walked.match_len = best.match_len;
      walked.score = best.score;  // the step's draft's
      walked.step_len = drafted;
      best = std::move(walked);
    }
    best.detours = detours(best, drafted, visited, params, pattern, m);
  }
  return best;
}

std::vector<Detour> SuffixTree::detours(const Draft& draft, int step_len, const std::vector<Position>& visited,
                                        const SpecParams& params, const int32_t* pattern, size_t m) const {
  // Every other token the tree has seen after each prefix of the step's draft, as likely as the tree
  // says (the chance of reaching that prefix times the token's share there).
  struct Outcome {
    double prob;
    int position;
    int32_t token;
    Position next;
  };
  std::vector<Outcome> outcomes;
  const bool continued = static_cast<int>(draft.token_ids.size()) > step_len;  // its bonus token is offered
  for (int j = 0; j <= step_len; ++j) {
    const Position at = visited[static_cast<size_t>(j)];
    const double reach = j == 0 ? 1.0 : draft.probs[static_cast<size_t>(j - 1)];
    const bool offered = j < step_len || continued;
    const int32_t taken = offered ? draft.token_ids[static_cast<size_t>(j)] : 0;
    const Node& node = nodes_[at.node];
    if (at.offset < length_of(node)) {
      const int32_t token = token_at(node, at.offset);
      if (!offered || token != taken) outcomes.push_back(Outcome{reach, j, token, Position{at.node, at.offset + 1}});
      continue;
    }
    for (uint32_t i = 0; i < node.nkids; ++i) {
      const Kid& kid = kid_arena_[node.kids + i];
      if (offered && kid.token == taken) continue;
      const double share = static_cast<double>(nodes_[kid.node].count) / static_cast<double>(node.count);
      outcomes.push_back(Outcome{reach * share, j, kid.token, Position{kid.node, 1}});
    }
  }
  std::stable_sort(outcomes.begin(), outcomes.end(),
                   [](const Outcome& a, const Outcome& b) { return a.prob > b.prob; });
  std::vector<Detour> found;
  std::vector<int32_t> path;
  for (const Outcome& outcome : outcomes) {
    if (static_cast<int>(found.size()) == kMaxDetours) break;
    // As for the continuation: the match grows by the accepted tokens and the target's.
    const size_t matched = m + static_cast<size_t>(outcome.position) + 1;
    const int budget = std::min(params.lookahead - 1, budget_for(params, matched));
    if (budget <= 0) continue;
    path.assign(pattern, pattern + m);
    path.insert(path.end(), draft.token_ids.begin(), draft.token_ids.begin() + outcome.position);
    path.push_back(outcome.token);
    Draft after = draft_path(outcome.next, budget, params, path.data(), path.size());
    if (after.token_ids.empty()) continue;
    found.push_back(Detour{outcome.position, outcome.token, std::move(after.token_ids), std::move(after.probs)});
  }
  return found;
}

Draft SuffixTree::draft_path(Position at, int budget, const SpecParams& params, const int32_t* pattern,
                             size_t m, std::vector<Position>* visited) const {
  // Follows the most frequent continuation while the path probability stays >= min_token_prob.
  // `pattern` (m tokens) is the matched context.
  Draft draft;
  double prob = 1.0;
  const size_t anchor = static_cast<size_t>(max_depth_ / 2);
  uint32_t length = length_of(nodes_[at.node]);
  while (static_cast<int>(draft.token_ids.size()) < budget) {
    const Position from = at;
    const Node& node = nodes_[at.node];
    int32_t token;
    if (at.offset < length) {
      token = token_at(node, at.offset);
      ++at.offset;
    } else if (node.nkids > 0) {
      const Kid& top = kid_arena_[node.kids];
      prob = prob * (static_cast<double>(nodes_[top.node].count) / static_cast<double>(node.count));
      if (prob < params.min_token_prob) break;
      at = Position{top.node, 1};
      length = length_of(nodes_[top.node]);
      token = top.token;
    } else if (params.reanchor && depth_of(node) == static_cast<uint32_t>(max_depth_) && anchor > 0) {
      // The trie ends here, not the stored text: go on from the last `anchor`
      // tokens of pattern + draft, a suffix of a stored pattern and so always in the trie.
      std::vector<int32_t> path(pattern, pattern + m);
      path.insert(path.end(), draft.token_ids.begin(), draft.token_ids.end());
      match(path.data(), path.size() - anchor, path.size(), &at);
      length = length_of(nodes_[at.node]);
      continue;
    } else {
      break;
    }
    if (draft.token_ids.empty()) {  // one allocation each, not one per doubling
      draft.token_ids.reserve(static_cast<size_t>(budget));
      draft.probs.reserve(static_cast<size_t>(budget));
    }
    draft.token_ids.push_back(token);
    draft.probs.push_back(prob);
    if (visited != nullptr) visited->push_back(from);
  }
  if (visited != nullptr) visited->push_back(at);
  draft.parents.reserve(draft.token_ids.size());
  for (size_t i = 0; i < draft.token_ids.size(); ++i) {
    draft.parents.push_back(static_cast<int32_t>(i) - 1);
    draft.score += draft.probs[i];
  }
  return draft;
}

namespace {

struct Candidate {
  double prob;
  std::vector<int32_t> path;  // tokens from the match position, the candidate's last
  uint32_t node;
  uint32_t offset;
  uint32_t sibling_parent;  // kNone inside an edge
  uint32_t index;           // among sibling_parent's children
  double parent_prob;
  int parent_out;
};

// Heap order: highest probability first, then the smaller token path.
bool worse(const Candidate& a, const Candidate& b) {
  if (a.prob != b.prob) return a.prob < b.prob;
  return b.path < a.path;
}

}  // namespace

Draft SuffixTree::draft_tree(Position at, int budget, double min_token_prob) const {
  // Best-first expansion: a candidate enters the heap only once its predecessor
  // in (prob desc, path asc) order, its parent or previous sibling, was taken.
  Draft draft;
  std::vector<Candidate> heap;
  auto push = [&heap](Candidate candidate) {
    heap.push_back(std::move(candidate));
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  auto push_child = [&](uint32_t parent, uint32_t index, double parent_prob, std::vector<int32_t> path, int parent_out) {
    const Kid& kid = kid_arena_[nodes_[parent].kids + index];
    double prob = parent_prob * (static_cast<double>(nodes_[kid.node].count) / static_cast<double>(nodes_[parent].count));
    path.push_back(kid.token);
    push(Candidate{prob, std::move(path), kid.node, 1, parent, index, parent_prob, parent_out});
  };
  auto push_next = [&](uint32_t node, uint32_t offset, double prob, const std::vector<int32_t>& path, int out) {
    const Node& record = nodes_[node];
    if (offset < length_of(record)) {  // inside an edge: one way on, no siblings
      std::vector<int32_t> next = path;
      next.push_back(token_at(record, offset));
      push(Candidate{prob, std::move(next), node, offset + 1, kNone, 0, prob, out});
    } else if (record.nkids > 0) {
      push_child(node, 0, prob, path, out);
    }
  };
  if (budget > 0) push_next(at.node, at.offset, 1.0, {}, -1);
  while (!heap.empty() && static_cast<int>(draft.token_ids.size()) < budget) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    Candidate taken = std::move(heap.back());
    heap.pop_back();
    if (taken.prob < min_token_prob) break;
    int out = static_cast<int>(draft.token_ids.size());
    draft.token_ids.push_back(taken.path.back());
    draft.parents.push_back(taken.parent_out);
    draft.probs.push_back(taken.prob);
    if (taken.sibling_parent != kNone && taken.index + 1 < nodes_[taken.sibling_parent].nkids) {
      std::vector<int32_t> parent_path(taken.path.begin(), taken.path.end() - 1);
      push_child(taken.sibling_parent, taken.index + 1, taken.parent_prob, std::move(parent_path), taken.parent_out);
    }
    push_next(taken.node, taken.offset, taken.prob, taken.path, out);
  }
  for (double prob : draft.probs) draft.score += prob;
  return draft;
}

}  // namespace speclane
