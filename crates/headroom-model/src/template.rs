//! Chat templates from `tokenizer_config.json`, rendered with minijinja (with Python-style
//! string methods, as Hugging Face templates expect).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, as OpenAI sends them back (templates render them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

impl ChatTemplate {
    /// Reads `chat_template` (a string, or a list of named templates, taking `default`) and the
    /// special tokens from a parsed `tokenizer_config.json`.
    pub fn from_tokenizer_config(config: &serde_json::Value) -> Result<Option<Self>> {
        let token = |key: &str| -> String {
            match &config[key] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            }
        };
        let source = match &config["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned)
                .ok_or_else(|| Error::Template("chat_template list has no template".into()))?,
            _ => return Ok(None),
        };
        let template = Self {
            source,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
        };
        // Fail at load time, not at the first request.
        template.environment()?;
        Ok(Some(template))
    }

    fn environment(&self) -> Result<minijinja::Environment<'static>> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", self.source.clone())
            .map_err(|e| Error::Template(format!("does not parse: {e}")))?;
        Ok(env)
    }

    /// Renders the conversation, ending with the assistant's turn opened when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.environment()?;
        let template = env.get_template("chat").expect("added above");
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| Error::Template(format!("rendering failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_python_methods() {
        let config = serde_json::json!({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>"},
            "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
        });
        let t = ChatTemplate::from_tokenizer_config(&config).unwrap().unwrap();
        assert_eq!(t.eos_token, "</s>");
        let out = t
            .render(&[ChatMessage::new("user", "  hi  ")], None, true)
            .unwrap();
        assert_eq!(out, "<|user|>hi\n<|assistant|>");
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let config = serde_json::json!({
            "chat_template": "{{ raise_exception('roles must alternate') }}"
        });
        let t = ChatTemplate::from_tokenizer_config(&config).unwrap().unwrap();
        let err = t.render(&[], None, true).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }
}
