// What `tessera plan` prints: ranked tables, the --explain arithmetic and --json objects
// for training layouts and serving configurations.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/plan/infer.h"
#include "tessera/plan/search.h"

namespace tessera::plan {

std::string format_bytes(double bytes);       // "12.3 GiB", "512 MiB"
std::string format_seconds(double seconds);   // "1.23 s", "4.5 ms", "3.2 days"

// Header line(s) naming the model, hardware and run.
std::string describe_train_setup(const ModelSpec& m, const Hardware& hw, const TrainSetup& s);
// Table of evaluations (rank, layout, memory breakdown, time breakdown, tokens/s, MFU).
std::string format_train_table(const std::vector<Evaluation>& evs);
// One layout in detail: memory parts of its worst stage, time parts, rates, time to train.
std::string format_train_summary(const Evaluation& ev, const TrainSetup& s);
std::string format_search_summary(const SearchResult& r);
// The arithmetic behind one layout, line by line.
std::string explain_train(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                          const Evaluation& ev);

nlohmann::json train_setup_json(const ModelSpec& m, const Hardware& hw, const TrainSetup& s);
nlohmann::json evaluation_json(const Evaluation& ev);

std::string describe_infer_setup(const ModelSpec& m, const Hardware& hw, const InferSetup& s);
std::string format_infer_table(const std::vector<InferEvaluation>& evs);
std::string explain_infer(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                          const InferEvaluation& ev);
nlohmann::json infer_evaluation_json(const InferEvaluation& ev);

}  // namespace tessera::plan
