#include "cache.h"

#include <cstring>
#include <stdexcept>
#include <unordered_set>

namespace speclane {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'L', 'D', 'R', 'A', 'F', 'T'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kLocalSequence = 0;  // the one sequence of a per-request tree: prompt + output

uint64_t fnv1a(const char* data, size_t n) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) hash = (hash ^ static_cast<uint8_t>(data[i])) * 0x100000001b3ull;
  return hash;
}

template <typename T>
void put(std::string* out, T value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T get() {
    T value;
    std::memcpy(&value, take(sizeof(T)), sizeof(T));
    return value;
  }
  const char* take(size_t n) {
    if (n > size_ - at_) throw std::invalid_argument("snapshot is truncated");
    const char* here = data_ + at_;
    at_ += n;
    return here;
  }
  size_t left() const { return size_ - at_; }

 private:
  const char* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace

Cache::Cache(int max_depth, int64_t max_cached_requests, int64_t max_cached_tokens)
    : max_depth_(max_depth), max_cached_requests_(max_cached_requests), max_cached_tokens_(max_cached_tokens) {
  if (max_depth < 1 || max_depth > 65535) throw std::invalid_argument("max_tree_depth must be between 1 and 65535");
  if (max_cached_tokens < 0) throw std::invalid_argument("max_cached_tokens must be >= 0");
}

Cache::Active& Cache::active(int64_t id) {
  auto it = active_.find(id);
  if (it == active_.end()) throw std::invalid_argument("request " + std::to_string(id) + " is not active");
  return it->second;
}

void Cache::start_request(int64_t id, const std::vector<int32_t>& prompt, const std::string& tenant,
                          const SessionParams& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (active_.count(id)) throw std::invalid_argument("request " + std::to_string(id) + " is already active");
  Active request{nullptr, nullptr, tenant, params};
  if (params.method == kMethodNgram) {
    request.ngram = std::make_unique<NgramIndex>(params.ngram_min, params.ngram_max, params.ngram_latest);
    request.ngram->append(prompt.data(), prompt.size());
    active_.emplace(id, std::move(request));
    return;
  }
  if (cached_.count(id)) evict(id);
  request.local = std::make_unique<SuffixTree>(params.local_depth > 0 ? params.local_depth : max_depth_);
  request.local->add_sequence(kLocalSequence);
  request.sequence = &request.local->sequence(kLocalSequence);
  request.local->append(*request.sequence, prompt.data(), prompt.size());
  Active& started = active_.emplace(id, std::move(request)).first->second;
  if (max_cached_requests_ == 0) return;
  add_response(id, tenant);
  if (cached_.count(id)) {
    started.responses = tenants_.at(tenant).get();
    started.response = &started.responses->tree.sequence(id);
  }
}

void Cache::add_response(int64_t id, const std::string& tenant) {
  std::unique_ptr<Tenant>& slot = tenants_[tenant];
  if (!slot) slot = std::make_unique<Tenant>(max_depth_);
  Tenant& responses = *slot;
  responses.tree.add_sequence(id);
  responses.fifo.push_back(id);
  all_fifo_.push_back(id);
  cached_.emplace(id, Cached{tenant, std::prev(responses.fifo.end()), std::prev(all_fifo_.end())});
  while (max_cached_requests_ > 0 && static_cast<int64_t>(responses.fifo.size()) > max_cached_requests_)
    evict(responses.fifo.front());
}

void Cache::append(Active& request, const int32_t* tokens, size_t n) {
  if (request.ngram) {
    request.ngram->append(tokens, n);
    return;
  }
  request.local->append(*request.sequence, tokens, n);
  // The response may already be evicted when more requests run than the cache holds.
  if (request.response == nullptr) return;
  request.responses->tree.append(*request.response, tokens, n);
  cached_tokens_ += static_cast<int64_t>(n);
  enforce_token_budget();
}

void Cache::enforce_token_budget() {
  while (max_cached_tokens_ > 0 && cached_tokens_ > max_cached_tokens_) evict(all_fifo_.front());
}

void Cache::add_active_response(int64_t id, const int32_t* tokens, size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  append(active(id), tokens, n);
}

void Cache::stop_request(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  active(id);
  active_.erase(id);
  auto cached = cached_.find(id);
  if (cached == cached_.end()) return;
  SuffixTree& tree = tenants_[cached->second.tenant]->tree;
  if (tree.sequence_length(id) == 0) {
    evict(id);  // an empty response teaches nothing
  } else {
    tree.seal(id);
  }
}

void Cache::evict_cached_response(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cached_.count(id)) throw std::invalid_argument("request " + std::to_string(id) + " has no cached response");
  evict(id);
}

void Cache::evict(int64_t id) {
  auto running = active_.find(id);
  if (running != active_.end()) running->second.responses = nullptr, running->second.response = nullptr;
  auto cached = cached_.find(id);
  auto tenant = tenants_.find(cached->second.tenant);
  Tenant& responses = *tenant->second;
  cached_tokens_ -= static_cast<int64_t>(responses.tree.sequence_length(id));
  responses.tree.remove_sequence(id);
  responses.fifo.erase(cached->second.in_tenant);
  all_fifo_.erase(cached->second.in_all);
  cached_.erase(cached);
  if (responses.fifo.empty()) tenants_.erase(tenant);
}

Draft Cache::propose(Active& request, const int32_t* context, size_t n, const SpecParams& params) {
  if (request.ngram) throw std::invalid_argument("an n-gram session has no suffix trees");
  Draft draft = request.local->speculate(context, n, params, request.sequence);
  draft.source = kSourceRequest;
  Tenant* responses = request.responses;
  if (responses == nullptr) {  // this response is not cached, others of its tenant may be
    auto tenant = tenants_.find(request.tenant);
    if (tenant != tenants_.end()) responses = tenant->second.get();
  }
  if (responses != nullptr) {
    Draft global = responses->tree.speculate(context, n, params, request.response);
    if (global.score > draft.score) {  // ties keep the request's own draft
      draft = std::move(global);
      draft.source = kSourceGlobal;
    }
  }
  return draft;
}

Draft Cache::speculate(int64_t id, const int32_t* context, size_t n, const SpecParams& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  return propose(active(id), context, n, params);
}

std::vector<Draft> Cache::step(const std::vector<int64_t>& ids, const std::vector<std::vector<int32_t>>& tokens,
                               const std::vector<StepBudget>& budgets) {
  if (ids.size() != tokens.size()) throw std::invalid_argument("need one token list per request id");
  if (!budgets.empty() && budgets.size() != ids.size()) throw std::invalid_argument("need one budget per request id");
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t id : ids) active(id);  // all or nothing
  std::vector<Draft> drafts;
  drafts.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    Active& request = active_.find(ids[i])->second;
    append(request, tokens[i].data(), tokens[i].size());
    if (request.ngram) {  // a lookup's draft simply goes on past k: its continuation is its next tokens
      const int k = request.params.spec.max_spec_tokens;
      Draft draft = request.ngram->propose(k + request.params.spec.lookahead);
      if (static_cast<int>(draft.token_ids.size()) > k) draft.step_len = k;
      drafts.push_back(std::move(draft));
    } else {
      const std::vector<int32_t>& context = request.local->sequence_tokens(kLocalSequence);
      SpecParams spec = request.params.spec;
      if (!budgets.empty()) {
        if (budgets[i].max_spec_factor > 0) spec.max_spec_factor = budgets[i].max_spec_factor;
        if (budgets[i].min_token_prob >= 0) spec.min_token_prob = budgets[i].min_token_prob;
      }
      drafts.push_back(propose(request, context.data(), context.size(), spec));
    }
  }
  return drafts;
}

std::vector<int64_t> Cache::active_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> ids;
  for (const auto& entry : active_) ids.push_back(entry.first);
  return ids;
}

std::vector<int64_t> Cache::cached_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::vector<int64_t>(all_fifo_.begin(), all_fifo_.end());
}

int64_t Cache::cached_tokens() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_tokens_;
}

size_t Cache::memory_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t bytes = sizeof(*this) + all_fifo_.size() * (sizeof(int64_t) + 2 * sizeof(void*));
  for (const auto& entry : tenants_)
    bytes += sizeof(Tenant) + entry.first.capacity() + entry.second->tree.memory_bytes() +
             entry.second->fifo.size() * (sizeof(int64_t) + 2 * sizeof(void*));
  bytes += cached_.bucket_count() * sizeof(void*) + cached_.size() * (sizeof(Cached) + sizeof(int64_t) + sizeof(void*));
  bytes += active_.bucket_count() * sizeof(void*);
  for (const auto& entry : active_) {
    bytes += sizeof(Active) + sizeof(int64_t) + sizeof(void*);
    if (entry.second.local) bytes += entry.second.local->memory_bytes();
    if (entry.second.ngram) bytes += entry.second.ngram->memory_bytes();
  }
  return bytes;
}

std::string Cache::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string payload;
  put<uint64_t>(&payload, all_fifo_.size());
  for (int64_t id : all_fifo_) {
    const std::string& tenant = cached_.at(id).tenant;
    const std::vector<int32_t>& tokens = tenants_.at(tenant)->tree.sequence_tokens(id);
    put<int64_t>(&payload, id);
    put<uint32_t>(&payload, static_cast<uint32_t>(tenant.size()));
    payload.append(tenant);
    put<uint64_t>(&payload, tokens.size());
    payload.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t));
  }
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(&out, kVersion);
  put<uint64_t>(&out, payload.size());
  out.append(payload);
  put<uint64_t>(&out, fnv1a(payload.data(), payload.size()));
  return out;
}

void Cache::restore(const std::string& data) {
  Reader header(data.data(), data.size());
  if (data.size() < sizeof(kMagic) || std::memcmp(header.take(sizeof(kMagic)), kMagic, sizeof(kMagic)) != 0)
    throw std::invalid_argument("not a speclane drafter snapshot (bad magic)");
  uint32_t version = header.get<uint32_t>();
  if (version != kVersion)
    throw std::invalid_argument("snapshot format version " + std::to_string(version) + ", this drafter reads " +
                                std::to_string(kVersion));
  uint64_t size = header.get<uint64_t>();
  if (size > header.left() || header.left() - size != sizeof(uint64_t))
    throw std::invalid_argument("snapshot is truncated or has trailing bytes");
  const char* payload = header.take(size);
  if (header.get<uint64_t>() != fnv1a(payload, size)) throw std::invalid_argument("snapshot checksum mismatch");

  // Parse everything before touching the cache: a bad entry leaves it untouched.
  struct Entry {
    int64_t id;
    std::string tenant;
    std::vector<int32_t> tokens;
  };
  std::vector<Entry> entries;
  std::unordered_set<int64_t> ids;
  Reader reader(payload, size);
  uint64_t count = reader.get<uint64_t>();
  for (uint64_t i = 0; i < count; ++i) {
    Entry entry;
    entry.id = reader.get<int64_t>();
    if (!ids.insert(entry.id).second) throw std::invalid_argument("snapshot repeats a request id");
    uint32_t tenant_size = reader.get<uint32_t>();
    entry.tenant.assign(reader.take(tenant_size), tenant_size);
    uint64_t n = reader.get<uint64_t>();
    if (n > reader.left() / sizeof(int32_t)) throw std::invalid_argument("snapshot is truncated");
    entry.tokens.resize(n);
    std::memcpy(entry.tokens.data(), reader.take(n * sizeof(int32_t)), n * sizeof(int32_t));
    for (int32_t token : entry.tokens)
      if (token < 0) throw std::invalid_argument("snapshot holds a negative token id");
    if (!entry.tokens.empty()) entries.push_back(std::move(entry));
  }
  if (reader.left() != 0) throw std::invalid_argument("snapshot has trailing bytes");

  std::lock_guard<std::mutex> lock(mutex_);
  if (!active_.empty() || !cached_.empty()) throw std::invalid_argument("restore needs an empty cache");
  if (max_cached_requests_ == 0) return;
  for (const Entry& entry : entries) {
    add_response(entry.id, entry.tenant);
    SuffixTree& tree = tenants_[entry.tenant]->tree;
    tree.append(entry.id, entry.tokens.data(), entry.tokens.size());
    tree.seal(entry.id);
    cached_tokens_ += static_cast<int64_t>(entry.tokens.size());
  }
  enforce_token_budget();
}

}  // namespace speclane
